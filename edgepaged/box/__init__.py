"""The box's models: the set of loaded models (models.py), the model store, pulls from the hub
and from Ollama's registry."""
