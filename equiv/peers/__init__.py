"""Peers: other libraries' trainers driven as their users drive them, their steps judged by equiv."""
