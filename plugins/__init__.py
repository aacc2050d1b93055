"""In-tree plugins of deepinfer. Each registers through the same entry-point groups a third party uses."""
