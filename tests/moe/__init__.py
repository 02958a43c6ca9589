"""Mixture-of-experts models: planning (expert splits, routing statistics) and execution."""
