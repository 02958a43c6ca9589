"""Built-in presets: model configs (``models``) and machines (``nodes``)."""
