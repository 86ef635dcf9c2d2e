"""The run's configuration: recipes (ml_collections configs), the checks a config passes before
anything heavy starts, config files and `--config.KEY` overrides, and study variants. The only
package below the entry points that reads `ConfigDict`s besides the composition root (`run/`)."""
