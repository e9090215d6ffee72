"""eyas.serve."""
