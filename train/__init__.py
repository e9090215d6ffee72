"""eyas.train."""
