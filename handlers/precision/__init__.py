"""The model in a precision: float casts, and int8 built, measured and rewritten for the ladder."""
