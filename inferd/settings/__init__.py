"""Settings: inferd.toml, then INFERD_* environment variables, then command-line flags, validated
once into frozen data that every other package reads. Each key is described once, by the
docstring under its field; docs/configuration.md, `inferd config --defaults` and the `serve`
flags are made from those.

    config.py       Settings (every table) and `load_settings`
    engine.py       [model], [cache], [scheduler], [shedding], [classes.NAME], [limits], [health], [runtime]
    server.py       [server], [tenants.NAME], [responses], [output_filter], [request_log]
    models.py       [models.NAME], [routes.NAME] and [degradation]: several models in one process
    policy.py       the scheduling policy as data: priority classes, timeouts, load shedding
    flags.py        the keys promoted to `inferd serve` flags
    docs.py         docs/configuration.md, from the descriptions (`python -m inferd.settings.docs`)
    defaults.py     `inferd config --defaults` and the shipped inferd.toml, from the descriptions
    environment.py  every environment variable inferd reads
    values.py       the table base, sizes, text files, key digests, SettingsError

The bottom of the house: it imports nothing of inferd's but itself (no engine, no API, no
torch), and everything above may import it.
"""
