"""Loading the model an archive carries."""
