"""What the engine, the trainer and the service share about a loaded model (torch lives here,
imported on use)."""
