"""Built-in models for the presets: small pure-torch networks and transformers configurations."""
