"""Safe rollout: canary and shadow traffic, output comparison, and a statistical verdict."""
