"""The config: its schema, the checks of a composed config, command-line overrides, composition,
what a config implies, and the metric names it logs. Nothing here imports torch."""
