"""eyas.common."""
