"""MONAI bundle integration."""
