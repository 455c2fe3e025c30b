"""Quality measurements: fidelity to full attention (more tasks to come, see issue 4)."""
