"""Entry points: the command line, chat, the demo and the daemon."""
