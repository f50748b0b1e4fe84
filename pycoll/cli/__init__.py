"""The command line: demo, doctor, draw, trace viewer, bench."""
