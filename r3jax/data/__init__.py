"""Math problem sets, prompts and the question iterator."""
