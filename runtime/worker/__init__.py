"""Worker processes that run one session's ops, apart from the front and each other."""
