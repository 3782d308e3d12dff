"""What every service uses to be operated: the /health, /ready and /metrics endpoint
(`health`) and the standard Prometheus metrics (`metrics`). Kept out of `shared/`, which
stays free of server code, and out of any one service's package, so every service may
import it."""
