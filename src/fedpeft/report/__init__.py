"""Reading run directories: tables and plots."""
