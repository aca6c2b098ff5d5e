"""toolledger.runtime"""
