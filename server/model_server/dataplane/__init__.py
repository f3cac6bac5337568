"""What a request does, whatever the frontend: pick a version, run it, count it."""
