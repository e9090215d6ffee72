"""eyas.data."""
