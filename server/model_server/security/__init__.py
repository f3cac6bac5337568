"""Who may call: bearer tokens (JWT, JWKS) and per-tenant rate limits."""
