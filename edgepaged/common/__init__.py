"""Small leaves every layer may use: short error texts, thread lanes, memory helpers, where
the box keeps its files, the request fields' rules."""
