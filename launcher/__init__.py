"""The coordinator, planner front end, driver API and CLI."""
