"""Everything that runs behind the bus: handlers run by one shared consume loop."""
