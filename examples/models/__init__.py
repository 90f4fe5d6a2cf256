"""Example models for rannc: a BiT-style ResNet and small test models."""
