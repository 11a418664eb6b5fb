"""kvgrid."""
