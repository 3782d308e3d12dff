"""Looking at a run from outside: `squall status` (status.py), `squall peek` (peek.py), `squall
dashboard` (dashboard.py over snapshot_json.py), the /health, /ready and /metrics endpoint
every service serves (health.py) with the standard Prometheus metrics (metrics.py), and `squall
acl` (acl.py). Kept out of `shared/`, which stays free of server code, so every service may
import health and metrics from here."""
