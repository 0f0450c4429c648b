"""Which requests run each step, with how many tokens: the scheduler, the prefix cache, sessions, slots."""
