"""`squall track`: a run's metrics, rewards, ledger counts and rollout samples, copied to W&B, TensorBoard and MLflow."""
