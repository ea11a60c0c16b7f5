"""Process groups for tensor parallelism: set-up, the rank's place in the group, and its collectives."""
