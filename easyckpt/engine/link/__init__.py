"""The trainer's links to others, running beside every step: its agent (the socket client, what it knows of the
agent, status reports and metrics), its peers (replicas, the ranks' collectives), SIGTERM agreement and the
run log."""
