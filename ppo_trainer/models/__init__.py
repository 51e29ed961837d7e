"""Models: path resolution and tokenizers (loading), the tiny test model (tiny), actor and critic."""
