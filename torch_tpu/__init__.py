"""placeholder"""
def _autoload():
    pass
