"""The Dash web timeline: queries, figures and callbacks."""
