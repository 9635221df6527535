"""Launch environments, hostlist expansion and process-group runtime."""
