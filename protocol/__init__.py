"""The contract between processes: the messages on every socket (and the OpenAI bodies
on HTTP), how they travel, and the few rules both ends must compute alike."""
