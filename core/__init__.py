"""What every layer shares, importing none of them: the error kinds (errors.py), the config
base (config.py), the wire types a request crosses Ray as (grammar_spec.py, params.py,
request.py), and the percentile and backoff helpers."""
