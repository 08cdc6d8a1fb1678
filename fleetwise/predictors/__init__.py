"""predictors"""
