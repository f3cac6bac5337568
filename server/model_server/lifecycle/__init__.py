"""One owner of each version's state: load, warm, check, swap, retain, retire, free."""
