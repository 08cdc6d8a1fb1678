"""Model shapes the planner knows by name, and parsing of user-supplied shapes."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from fleetwise.schemas import ModelShape, describe_error


def _gpt(name: str, layers: int, hidden: int, heads: int) -> ModelShape:
    # Narayanan et al. 2021 (arXiv 2104.04473) Sec. 5.1: vocabulary 51,200, sequence 2,048.
    return ModelShape(name=name, layers=layers, hidden=hidden, heads=heads, seq_len=2048, vocab=51200)


def _llama(name: str, layers: int, hidden: int, heads: int, ffn: int, kv_heads: int | None) -> ModelShape:
    # Llama 2 (Touvron et al. 2023, arXiv 2307.09288, Table 1 and the released configs):
    # SwiGLU MLP (three h x ffn matrices), 32,000-token vocabulary, 4,096-token context.
    # `gated_mlp` is an extra key of the record: the MLP has three matrices, not two.
    return ModelShape(
        name=name, layers=layers, hidden=hidden, heads=heads, seq_len=4096, vocab=32000,
        ffn_hidden=ffn, kv_heads=kv_heads, gated_mlp=True,
    )


# Shapes of Narayanan et al. 2021, Table 1 (heads / hidden / layers), plus common models.
MODEL_PRESETS: dict[str, ModelShape] = {
    # Megatron-LM's GPT 1.3B example (24 layers, hidden 2048, 16 heads).
    "gpt-1.3b": _gpt("gpt-1.3b", 24, 2048, 16),
    "gpt-1.7b": _gpt("gpt-1.7b", 24, 2304, 24),
    "gpt-3.6b": _gpt("gpt-3.6b", 30, 3072, 32),
    "gpt-7.5b": _gpt("gpt-7.5b", 36, 4096, 32),
    "gpt-18b": _gpt("gpt-18b", 40, 6144, 48),
    "gpt-39b": _gpt("gpt-39b", 48, 8192, 64),
    "gpt-76b": _gpt("gpt-76b", 60, 10240, 80),
    "gpt-145b": _gpt("gpt-145b", 80, 12288, 96),
    "gpt-310b": _gpt("gpt-310b", 96, 16384, 128),
    "gpt-530b": _gpt("gpt-530b", 105, 20480, 128),
    "gpt-1t": _gpt("gpt-1t", 128, 25600, 160),
    # GPT-3 175B (Brown et al. 2020, arXiv 2005.14165, Table 2.1): 96 layers, d 12288, 96 heads.
    "gpt-175b": _gpt("gpt-175b", 96, 12288, 96),
    "llama-7b": _llama("llama-7b", 32, 4096, 32, 11008, None),
    "llama-13b": _llama("llama-13b", 40, 5120, 40, 13824, None),
    "llama-70b": _llama("llama-70b", 80, 8192, 64, 28672, 8),
}


def resolve_model(name: str) -> ModelShape:
    """A preset by name (case-insensitive); raises ``ValueError`` listing the presets."""
    key = name.strip().lower()
    if key in MODEL_PRESETS:
        return MODEL_PRESETS[key].model_copy(deep=True)
    raise ValueError(f"unknown model {name!r}; presets: {', '.join(sorted(MODEL_PRESETS))}")


def parse_model_dict(data: dict[str, Any]) -> ModelShape:
    """A model shape from a YAML/JSON mapping ``{name, layers, hidden, heads, seq_len, vocab,
    ffn_hidden?, kv_heads?, gated_mlp?}``; raises ``ValueError`` naming the bad fields."""
    if not isinstance(data, dict):
        raise ValueError(f"model file must hold a mapping of fields, got {type(data).__name__}")
    try:
        return ModelShape.model_validate(data)
    except ValidationError as exc:
        raise ValueError(f"model: {describe_error(exc)}") from None


def load_model(name_or_text: str, text: str | None = None) -> ModelShape:
    """A preset name, or (when ``text`` is given) a YAML/JSON document describing a model."""
    if text is None:
        return resolve_model(name_or_text)
    import yaml  # YAML is a superset of JSON; parsing text is not I/O

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"model file {name_or_text!r} is not valid YAML/JSON: {exc}") from None
    return parse_model_dict(data)
