"""Privacy accounting on Google's dp-accounting."""
