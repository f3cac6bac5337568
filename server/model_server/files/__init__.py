"""Files read without following links, and private copies of what the server loads."""
