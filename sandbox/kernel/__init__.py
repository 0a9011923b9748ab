"""The Jupyter kernel driver shared by the backends that run ipykernel themselves."""
