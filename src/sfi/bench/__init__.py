"""Measurement: throughput against full attention and the bandwidth floor."""
