"""Settings: inferd.toml, then INFERD_* environment variables, then command-line flags, validated
once into frozen data that every other package reads.

    config.py   the [server], [model], [cache], [scheduler], [classes], [tenants], ... sections
                and `load_settings`
    models.py   [models.NAME], [routes.NAME] and [degradation]: several models in one process
    policy.py   the scheduling policy as data: priority classes, timeouts, load shedding
    values.py   sizes, text files, key digests, SettingsError

The bottom of the house: it imports nothing of inferd's but itself (no engine, no API, no
torch), and everything above may import it.
"""
