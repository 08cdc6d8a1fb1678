import sys
from pathlib import Path

# Make `tests.*` importable however pytest is launched (`pytest`, `python -m pytest`, from any cwd).
_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

pytest_plugins = ["tests.kafka_broker", "tests.kube_server"]
