"""Showing a run outside Jupyter's widgets: the terminal, the executed notebook's text, the ending line,
the SVG metric plot (which the live view uses too). Nothing here imports IPython or torch."""
