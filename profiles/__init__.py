"""Hardware profiles as data: one TOML file per device, every number with its source."""
