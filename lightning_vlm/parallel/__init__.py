"""Running on several processes: collectives the methods need, and Lightning strategies set up for VLMs."""
