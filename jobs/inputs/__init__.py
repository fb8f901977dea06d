"""Reading a job's input: one reader interface, Parquet and OpenAI batch files behind it."""
