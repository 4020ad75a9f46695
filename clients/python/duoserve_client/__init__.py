"""duoserve client SDK."""
